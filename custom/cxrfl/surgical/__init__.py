"""Surgical aggregation and its baselines (head modes): maths, site learner, transport-free server loop."""
