"""What every part shares: one way to fail (`errors`), the parser of every command and the text of a
number (`cli`), what a location is and the probe of an output (`locations`), files written whole
(`files`), image decoding and the keys of an image's geometry (`images`), the offline CLIP tokenizer
(`tokenizer`), MDS file names and an index's check (`mds`).

May import: nothing of the project outside `core/`.
"""
