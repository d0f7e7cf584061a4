"""The tests of t2ibench/memory/."""
