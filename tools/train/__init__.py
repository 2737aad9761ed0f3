"""Training, tokenizer and evaluation code for the bundled demo model (moerun/demo_model).

Not imported by the inference path; it needs `transformers` (a test dependency) at run time.
"""
