from specdec.serving.entrypoint import run_model_service
from specdec.target_server.config import TargetConfig
from specdec.target_server.server import create_server

if __name__ == "__main__":
    run_model_service("target_server", TargetConfig, create_server)
