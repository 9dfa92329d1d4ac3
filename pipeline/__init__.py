"""The runner: config -> resolved plan -> running collector graph -> trainer loop."""
