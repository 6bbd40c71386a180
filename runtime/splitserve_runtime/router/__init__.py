"""The router: an OpenAI-compatible front that sends each prompt to the prefill pod whose
prefix cache already holds it and the decode pod with the most KV headroom (see policy.py),
then relays the decode pod's stream (see proxy.py)."""
