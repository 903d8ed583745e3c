"""Site data: readers for the published label formats, patient splits, transforms, summaries."""
