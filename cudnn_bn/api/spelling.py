"""How the array API's errors name arguments: as its callers pass them."""

from ..errors import raises_only_infini_errors
from ..problems import BackwardTensors, ForwardInferenceTensors, ForwardTrainingTensors

# The operators name tensor descriptors (``input_desc is NULL``); this API's callers pass
# arrays (``input is None``).
SPELLING = {
    f"{name}_desc": name
    for tensors in (BackwardTensors, ForwardInferenceTensors, ForwardTrainingTensors)
    for name in tensors._fields
} | {"NULL": "None"}
array_api = raises_only_infini_errors(SPELLING)
