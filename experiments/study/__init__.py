"""Experiments that reproduce srtrain's numerics: stalls vs theory, ablations, frozen weights."""
