"""Minitron's activation importance (``importance``) and its registration as a scorer (``plugin``)."""
