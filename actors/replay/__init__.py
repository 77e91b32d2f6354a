"""Experience replay for off-policy algorithms: ring storage, sum tree, samples-per-insert limiter."""
from actors.replay.rate_limiter import RateLimiter, RateLimiterTimeout
from actors.replay.multi_agent import MultiAgentReplay
from actors.replay.replay import ReplayBuffer, ReplaySettings
from actors.replay.sum_tree import SumTree

__all__ = ["MultiAgentReplay", "ReplayBuffer", "ReplaySettings", "RateLimiter", "RateLimiterTimeout", "SumTree"]
