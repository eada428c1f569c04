"""The inference engine: scheduler, KV block manager, model runner, sampling.

Dependency direction: engine -> kernels, platform. Scheduler and block bookkeeping are torch-free.
"""

from tandem.engine.protocol import CompletionOutput, GenerationRequest, RequestOutput
from tandem.engine.request import Priority
from tandem.engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "GenerationRequest", "Priority", "RequestOutput", "SamplingParams"]
