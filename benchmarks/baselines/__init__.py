"""Servers our engine is compared against; see README.md beside this file."""
