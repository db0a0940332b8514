"""The reward service (``flowrl serve-rewards CONFIG``): rewards served over HTTP by Ray Serve.

- :mod:`~flowrl.reward_service.config`: the service's YAML config (address, size cap, one deployment per reward);
- :mod:`~flowrl.reward_service.deployments`: the Serve deployments (a scorer per reward, the HTTP ingress);
- :mod:`~flowrl.reward_service.launch`: the checks before deploying, and starting and stopping the service.

Clients speak the wire format of docs/remote_reward.md (:mod:`flowrl.reward_wire`), e.g. ``rewards.remote``'s
``RemoteReward``. Nothing here imports Ray at import time.
"""
