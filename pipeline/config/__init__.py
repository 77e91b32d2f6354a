"""AlgorithmConfig and its setting groups, each with its validation; RLlib's old names."""
