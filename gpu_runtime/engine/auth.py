"""Who may talk to an engine or a router: moved to ``gpu_runtime.proc.auth``, a layer below
``engine/``, so the weight server of the pull path (``weight_sync/``) keeps the same rules.
Importers still naming this module get the same objects; new code imports ``proc.auth``."""

from gpu_runtime.proc.auth import ENGINE_TOKEN_ENV as ENGINE_TOKEN_ENV
from gpu_runtime.proc.auth import authorized as authorized
from gpu_runtime.proc.auth import bearer_headers as bearer_headers
from gpu_runtime.proc.auth import check_exposure as check_exposure
from gpu_runtime.proc.auth import engine_token as engine_token
from gpu_runtime.proc.auth import is_loopback as is_loopback
