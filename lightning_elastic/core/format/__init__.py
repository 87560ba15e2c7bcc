"""The on-disk format: manifest, DCP metadata as JSON, the skeleton of saved containers, the
catalog of a root directory, and verification against a manifest. Torch-free except
``dcp_json`` and ``skeleton`` users."""
