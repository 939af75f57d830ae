"""The shared vocabulary every layer speaks, importing no other neva_pack module: errors that carry
one line for the user, defaults written once, the image run, the processor's normalisation, the stored
image of a dynamic-resolution family, and DataLoader workers that behave.
"""

from neva_pack.core.defaults import IGNORE_INDEX, PAD_ID, VERSION
from neva_pack.core.errors import ConfigError, InputError, NevaPackError, OutputError, parsing
from neva_pack.core.image_run import ImageRun
from neva_pack.core.normalisation import Normalisation
from neva_pack.core.numba_cache import use_user_numba_cache
from neva_pack.core.stored_image import StoredImage
from neva_pack.core.workers import passthrough, worker_messages

use_user_numba_cache()

__all__ = [
    "ConfigError",
    "IGNORE_INDEX",
    "ImageRun",
    "InputError",
    "NevaPackError",
    "Normalisation",
    "OutputError",
    "PAD_ID",
    "StoredImage",
    "VERSION",
    "parsing",
    "use_user_numba_cache",
    "passthrough",
    "worker_messages",
]
