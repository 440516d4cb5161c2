"""mlx-dspark: lossless speculative decoding on MLX.

Output is identical to plain decoding of the target (greedy), or an exact sample of it (T > 0).
"""

from ._version import __version__
from .api import GenerationResult, encode_prompt, generate, stream_generate  # noqa: E402
from .decode.sampling import SamplingParams  # noqa: E402
from .errors import UserError  # noqa: E402
from .models.loading import load_target  # noqa: E402
from .pairs import dflash_generate, load_dflash_pair, load_pair, speculative_generate  # noqa: E402

__all__ = [
    "GenerationResult",
    "SamplingParams",
    "UserError",
    "dflash_generate",
    "encode_prompt",
    "generate",
    "load_dflash_pair",
    "load_pair",
    "load_target",
    "speculative_generate",
    "stream_generate",
    "__version__",
]
