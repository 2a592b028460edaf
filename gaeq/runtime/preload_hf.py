"""Imported by the fork server as well when a problem has a transformers model
(``model: {hf: ...}``) or a cell runs the transformers Trainer (server.preload_modules adds the
Trainer's own module then): transformers' machinery takes seconds to
import, paid here once instead of by every rank of every process group. Never imported otherwise
(the extra is optional)."""

import transformers.modeling_utils  # noqa: F401  (PreTrainedModel: most of the import time)
from transformers.models.auto import modeling_auto  # noqa: F401  (the causal-LM mapping gaeq checks names against)
