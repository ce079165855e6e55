//! The official `openai` Python client against a real server: completions and chat, streaming and not, with usage.

use crate::common::api::{run_client_check, server};

#[test]
fn the_openai_python_client_works_unchanged() {
    run_client_check("openai_client_check.py", &server().base);
}
