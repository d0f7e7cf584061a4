"""The tests of t2ibench/costs/."""
