"""mlx-dspark: lossless speculative decoding on MLX.

Output is identical to plain decoding of the target (greedy), or an exact sample of it (T > 0).
"""

__version__ = "0.1.0"

from .api import GenerationResult, encode_prompt, generate, stream_generate  # noqa: E402
from .decode.sampling import SamplingParams  # noqa: E402
from .errors import UserError  # noqa: E402
from .models.loading import load_target  # noqa: E402

__all__ = ["GenerationResult", "SamplingParams", "UserError", "encode_prompt", "generate", "load_target",
           "stream_generate", "__version__"]
