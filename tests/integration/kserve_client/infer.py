"""Run KServe's InferenceRESTClient against a server; runs in the kserve venv, not .venv.

Reads ``{"base_url", "values", "lengths"}`` as JSON on stdin, asks liveness and model
readiness, then infers twice (JSON tensors, then binary tensors with binary outputs) and
prints ``{"live", "model_ready", "json": {...}, "binary": {...}}`` with every output as
a nested list and the answer's parameters.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig


async def main() -> None:
    spec = json.load(sys.stdin)
    base_url = spec["base_url"]
    values = np.asarray(spec["values"], dtype=np.float32)
    lengths = np.asarray(spec["lengths"], dtype=np.int64)
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
    out: dict = {
        "live": await client.is_server_live(base_url),
        "model_ready": await client.is_model_ready(base_url, "streamtrain"),
    }
    for mode, binary in (("json", False), ("binary", True)):
        value_input = InferInput("values", list(values.shape), "FP32")
        value_input.set_data_from_numpy(values, binary_data=binary)
        length_input = InferInput("lengths", list(lengths.shape), "INT64")
        length_input.set_data_from_numpy(lengths, binary_data=binary)
        request = InferRequest(
            model_name="streamtrain",
            infer_inputs=[value_input, length_input],
            request_id=f"kserve-{mode}",
            parameters={"binary_data_output": True} if binary else None,
        )
        response = await client.infer(base_url, request, model_name="streamtrain")
        out[mode] = {
            "id": response.id,
            "parameters": dict(response.parameters or {}),
            "outputs": {o.name: o.as_numpy().tolist() for o in response.outputs},
        }
    await client.close()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main())
