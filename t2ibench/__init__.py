"""The parts the benchmark's commands are built from (the commands themselves stay at the root)."""
