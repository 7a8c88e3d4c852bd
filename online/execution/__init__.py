"""A package of the online stage."""
