"""Whole networks composed from the ops of refmath, each with a hand-written forward and backward."""
