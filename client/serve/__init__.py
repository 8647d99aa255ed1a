"""The server process: tritonserver with the tritium backend, its launch checks, the HTTP guard."""
