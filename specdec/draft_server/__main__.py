from specdec.draft_server.config import DraftConfig
from specdec.draft_server.server import create_server
from specdec.serving.entrypoint import run_model_service

if __name__ == "__main__":
    run_model_service("draft_server", DraftConfig, create_server)
