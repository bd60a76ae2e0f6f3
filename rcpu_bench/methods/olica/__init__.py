"""Olica's linear calibration of a pruned module (``calibration``) and its registration as a compensator
(``plugin``)."""
