"""What crosses a boundary: episode chunks, the codec, space descriptions.

Imports only numpy, msgpack, lz4 (and gymnasium, lazily, for spaces) -- never ray or torch.
"""
from protocols.codec import Limits, decode, encode
from protocols.episode import EpisodeBuilder, EpisodeChunk, new_episode_id
from protocols.errors import ProtocolError
from protocols.spaces import space_from_dict, space_to_dict

__all__ = [
    "EpisodeBuilder",
    "EpisodeChunk",
    "Limits",
    "ProtocolError",
    "decode",
    "encode",
    "new_episode_id",
    "space_from_dict",
    "space_to_dict",
]
