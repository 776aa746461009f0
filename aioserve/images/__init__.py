"""Images in prompts, from a request's reference to what the scheduler takes.

An image part's URL (a data URL, an http(s) URL, a local file under
--allowed-local-media-path) is read into bytes off the event loop with
every bound held (sources.py, http_fetch.py, addresses.py), decoded with a
pixel cap read from the header before any decoding (decode.py), and run
through the checkpoint's own image processor on the tokenizer's threads
(processing.py): a ProcessedImage (aioserve/image_inputs.py). A prompt's
image placeholders are then expanded to each image's tokens (prompt.py).
The families a checkpoint may belong to (Qwen2.5-VL first) are in
family.py, qwen_vl.py and registry.py; intake.py holds it all together for
the server. Whatever a client's image does wrong is an ImageError, which
the server answers with a 400 naming the part.

Beside the tokenizer (rank 6.5), independent of it: what needs the
tokenizer is handed in (a runner of its thread pool, a token lookup).
"""

from aioserve.images.errors import ImageError
from aioserve.images.intake import ImageIntake, load_image_intake
from aioserve.images.settings import MediaSettings

__all__ = ["ImageError", "ImageIntake", "MediaSettings", "load_image_intake"]
