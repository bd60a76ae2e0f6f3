"""Týr-the-Pruner's searched allocation (Li et al., NeurIPS 2025): its grid and evolution (``genome``), its candidates
on disk (``supernet``), its fitness (``fitness``), the search that runs them (``driver``) and its registration
(``plugin``)."""
