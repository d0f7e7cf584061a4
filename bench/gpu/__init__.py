"""bench/gpu_report.py's parts, one job each, imported, never run: the rows (`rows`), a row's plan
(`plan`), its launch (`launch`), the time budget (`budget`), the record written (`record`).
"""
