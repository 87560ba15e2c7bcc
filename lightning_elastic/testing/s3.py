"""A real S3 protocol server on loopback (moto's server mode) for tests and demos."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["S3Server"]


class S3Server:
    """moto's ``ThreadedMotoServer`` on 127.0.0.1 and a free port, with fake credentials.

    ``storage_options`` is what ``Storage``/``CheckpointEngine`` need to reach it through s3fs.
    """

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)

        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ.setdefault(key, "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """The fsspec options (fake credentials, endpoint) that reach this server through s3fs."""
        return {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def create_bucket(self, name: str) -> str:
        """Create the bucket ``name`` and return its URL, ``s3://name``."""
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        """Stop the server."""
        self._server.stop()
