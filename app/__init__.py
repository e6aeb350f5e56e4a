"""The Gradio chat front end over `engine` (which never imports Gradio): UI, token provenance, speedup meter."""
