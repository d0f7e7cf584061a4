"""The tests of t2ibench/commands/."""
