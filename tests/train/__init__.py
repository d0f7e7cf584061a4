"""The tests of t2ibench/train/."""
