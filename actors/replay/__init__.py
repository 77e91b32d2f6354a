"""Experience replay for off-policy algorithms: ring storage, sum tree, samples-per-insert limiter."""
from actors.replay.rate_limiter import RateLimiter, RateLimiterTimeout
from actors.replay.multi_agent import MultiAgentReplay
from actors.replay.replay import MAX_BATCHES_PER_CALL, ReplayBuffer, ReplaySettings
from actors.replay.sum_tree import SumTree

__all__ = ["MAX_BATCHES_PER_CALL", "MultiAgentReplay", "ReplayBuffer", "ReplaySettings", "RateLimiter", "RateLimiterTimeout", "SumTree"]
