"""The driver's handles on its stage groups: env runners, learners, evaluators."""
