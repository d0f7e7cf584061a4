"""The tests of t2ibench/families/."""
