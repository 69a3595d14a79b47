"""Engine integrations, each imported only on request (none is imported by ``pat_core``).

``pat_core.integrations.transformers``  pat as the decode attention of Hugging Face
                                         transformers' continuous batching (extra
                                         ``.[transformers]``; see docs/engines.md)
"""
