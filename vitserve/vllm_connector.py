"""The module path users give vLLM for vitserve's connector (`"ec_connector_module_path":
"vitserve.vllm_connector"`): a re-export of vitserve/connector/glue.py, where the connector lives."""

from vitserve.connector.glue import MODULE_PATH, VitserveECConnector, VitserveECMetadata

__all__ = ["MODULE_PATH", "VitserveECConnector", "VitserveECMetadata"]
