import pytest

# tests/vllm/test_front_door.py runs the cases of these modules: their asserts explain themselves there too
pytest.register_assert_rewrite("tests.vllm.ec_cases", "tests.vllm.stack")
