//! Copies out of the device in the background (device table revision 1.2): blocks being copied go to no other request until their copy ended, a copy that spans decode steps gives the fresh tokens on reload, a worker that crashes during a copy leaves nothing indexed, and a device without the entries keeps the synchronous path.

use std::time::Duration;

use super::offload::{DEADLINE, POOL, complete, complete_text, metric, prompt_a, prompt_b, stop};
use super::serve_support::Server;

const MOCK: &str = "libplughost_device_mock.so";
const MEMORY_TIER: &[&str] = &["--kv-offload-memory", "1MiB"];
const STORED: &str = "plughost_kv_tier_blocks_moved_total{direction=\"device_to_host\"}";
const MEMORY_HITS: &str = "plughost_kv_tier_hit_tokens_total{tier=\"memory\"}";

/// A's and B's texts from a server without tiers.
async fn fresh_texts() -> (String, String) {
    let fresh = Server::start_on(MOCK, POOL);
    let texts = (
        complete(&fresh, &prompt_a()).await.text,
        complete(&fresh, &prompt_b()).await.text,
    );
    stop(fresh);
    texts
}

#[tokio::test]
async fn blocks_being_copied_go_to_no_other_request_until_their_copy_ended() {
    // D (80 prompt tokens, 40 more decoded at a few launches of 1 ms each) runs while A
    // finishes; A's copy out then waits 1.5 s on the device's copy thread while D's steps go
    // on. B (28 blocks) does not fit beside D (20 to 30 blocks) and A's 17 pinned blocks, so it
    // can only be admitted once A's copy ended and unpinned them; it evicts some of them, and A
    // comes back from the device and host memory.
    let pool = [
        "--block-size",
        "4",
        "--num-kv-blocks",
        "64",
        "--max-num-seqs",
        "2",
    ];
    let d: Vec<u32> = (100..180).collect();
    let b: Vec<u32> = (200..304).collect();
    let slow = ["--device-config", "launch_ms=1"];
    let fresh = Server::start_on(MOCK, &[&pool[..], &slow].concat());
    let fresh_a = complete(&fresh, &prompt_a()).await.text;
    let fresh_b = complete(&fresh, &b).await.text;
    let fresh_d = complete_text(&fresh, &d, 40).await;
    stop(fresh);

    let flags = [
        &pool[..],
        MEMORY_TIER,
        &["--device-config", "launch_ms=1,copy_ms=1500"],
    ]
    .concat();
    let server = Server::start_on(MOCK, &flags);
    server.wait_for_log("copies out of the device in the background", DEADLINE);
    let a_then_b = async {
        let a = complete(&server, &prompt_a()).await;
        let b = complete(&server, &b).await;
        // Had B taken A's blocks while they were being copied, it would have answered before
        // the copy ended and was counted.
        let stored = metric(&server, STORED).await;
        (a, b, stored)
    };
    let ((a, b, stored), long) =
        futures::future::join(a_then_b, complete_text(&server, &d, 40)).await;
    assert_eq!(a.text, fresh_a);
    assert_eq!(b.text, fresh_b);
    assert_eq!(
        long, fresh_d,
        "D decoded unchanged while A's blocks were copied"
    );
    assert!(
        stored >= 14.0,
        "A's blocks were stored before B ran: {stored}"
    );
    let again = complete(&server, &prompt_a()).await;
    assert_eq!(again.text, fresh_a, "A from the device and host memory");
    assert_eq!(again.cached_tokens, 56);
    assert!(
        metric(&server, MEMORY_HITS).await > 0.0,
        "{}",
        server.stderr()
    );
    stop(server);
}

#[tokio::test]
async fn a_worker_that_crashes_during_a_copy_leaves_nothing_indexed() {
    let (fresh_a, fresh_b) = fresh_texts().await;
    let flags = [
        POOL,
        MEMORY_TIER,
        &[
            "--device-isolation",
            "process",
            "--device-config",
            "crash_copy=1",
        ],
    ]
    .concat();
    let server = Server::start_on(MOCK, &flags);
    // A's blocks go into the first copy out, during which the worker aborts.
    assert_eq!(complete(&server, &prompt_a()).await.text, fresh_a);
    server.wait_for_log("KV blocks out of the device", Duration::from_secs(60));
    // B meets the lost worker, which is restarted (its copies no longer crash).
    assert_eq!(complete(&server, &prompt_b()).await.text, fresh_b);
    // Nothing of A reached host memory, and the new worker's pool never held it.
    let again = complete(&server, &prompt_a()).await;
    assert_eq!(again.text, fresh_a, "A computed again");
    assert_eq!(again.cached_tokens, 0, "{}", server.stderr());
    assert_eq!(metric(&server, MEMORY_HITS).await, 0.0);
    stop(server);
}

#[tokio::test]
async fn a_device_without_background_copies_keeps_the_synchronous_path() {
    let (fresh_a, fresh_b) = fresh_texts().await;
    let flags = [POOL, MEMORY_TIER].concat();
    // The mock device's `TABLE_REVISION_ENV`.
    let revision = [("PLUGHOST_MOCK_DEVICE_TABLE_REVISION", "1.1")];
    let server = Server::start_with_env(MOCK, &flags, &revision);
    server.wait_for_log("synchronously, between steps", DEADLINE);
    assert_eq!(complete(&server, &prompt_a()).await.text, fresh_a);
    assert_eq!(complete(&server, &prompt_b()).await.text, fresh_b);
    let again = complete(&server, &prompt_a()).await;
    assert_eq!(again.text, fresh_a, "A from host memory");
    assert_eq!(again.cached_tokens, 56);
    assert_eq!(metric(&server, MEMORY_HITS).await, 56.0);
    stop(server);
}
