"""The preloaded server's first import (core/processes.py, PRELOAD): the server then ends without tearing torch and
MLflow down. Imported anywhere else, it does nothing."""

from replaybisect.core.processes import end_server_without_teardown

end_server_without_teardown()
