"""The tests of t2ibench/datasets/."""
