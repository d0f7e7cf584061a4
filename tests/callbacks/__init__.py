"""The tests of t2ibench/callbacks/."""
