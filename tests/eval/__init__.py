"""The tests of t2ibench/eval/."""
