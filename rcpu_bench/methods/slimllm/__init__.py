"""SlimLLM's linear regression of a pruned module's output rows (``regression``) and its registration as a
compensator (``plugin``)."""
