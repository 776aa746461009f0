"""One thread at a time in transformers' lazy imports.

The server loads the tokenizer on one thread while the engine loads the
model on another, and both may reach into transformers, which builds its
package lazily on first use. Two threads importing it at once can each hold
a module the other needs; Python then hands one of them a partially
initialised module ("cannot import name 'is_tokenizers_available' from
partially initialized module 'transformers.utils'"). Every use of
transformers in aioserve's threads holds this lock.
"""

from __future__ import annotations

import threading

HF_IMPORT_LOCK = threading.Lock()
