//! `serve` with a deployment or device it cannot use exits naming the cause: a broken component, another contract version, a renamed field, a device of another ABI.

use super::*;

/// A deployment that cannot start makes `serve` exit non-zero with the cause, not serve 503:
/// a trap in `init`, a component of the wrong world, one built for another contract version.
#[test]
fn serve_with_a_broken_deployment_exits_with_the_cause() {
    let dir = scratch("broken");
    let other_version = other_version_component(&dir);
    let cases = [
        (
            deployment(
                "plughost_scheduler_faulty.wasm",
                "{ trap_in_init = true }",
                "plughost_sampler_standard.wasm",
            ),
            vec!["[scheduler]".to_string(), "trap".to_string()],
        ),
        (
            deployment(
                "plughost_scheduler_fcfs.wasm",
                "{}",
                "plughost_scheduler_fcfs.wasm",
            ),
            vec![format!(
                "{} exports the scheduler world; the [sampler] slot needs sampler",
                plugin("plughost_scheduler_fcfs.wasm")
            )],
        ),
        (
            other_version_deployment(&dir),
            vec![format!(
                "component {} was built for plughost:plugin@0.3.0; this host speaks 0.1.x or 0.2.x",
                other_version.display()
            )],
        ),
        (
            format!(
                "[sampler]\ncomponent = \"{}\"\n",
                renamed_field_component(&dir).display()
            ),
            vec![
                "[sampler]".to_string(),
                "record `sampling-params` of plughost:plugin/sampling@0.2.0 differs: field 4 is \
                 `min-p` in this host and `max-p` in the component"
                    .to_string(),
            ],
        ),
    ];
    for (n, (text, needles)) in cases.iter().enumerate() {
        let config = dir.join(format!("deploy-{n}.toml"));
        write_file(&config, text);
        let log = serve_until_exit(&["--config", &config.display().to_string()]);
        for needle in needles {
            assert!(
                log.contains("error:") && log.contains(needle.as_str()),
                "{needle:?} not in {log}"
            );
        }
    }
}

/// A device library of another ABI version makes `serve` exit non-zero naming both versions.
#[test]
fn serve_with_a_device_of_another_abi_exits_with_both_versions() {
    let device = plugin("libplughost_device_wrong_abi.so");
    let log = serve_until_exit(&["--device", &device]);
    let needle = format!("device library `{device}` speaks device ABI 999; this host speaks 1");
    assert!(log.contains(&needle), "{needle:?} not in {log}");
}

/// Runs `serve` with `args`, which must make it exit non-zero, and returns its stderr.
fn serve_until_exit(args: &[&str]) -> String {
    let started = Instant::now();
    let mut child = Server::command(free_port(), args)
        .spawn()
        .expect("plughost starts");
    let log = collect_stderr(&mut child);
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll plughost") {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("serve kept running with {args:?}");
        }
        std::thread::sleep(POLL);
    };
    eprintln!(
        "serve exited after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    std::thread::sleep(Duration::from_millis(200));
    let log = log.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(!status.success(), "{log}");
    log
}

/// A copy of the standard sampler whose import and export names say `plughost:plugin@0.3.0`:
/// the version string has the same length, so the rewritten component stays well formed.
fn other_version_component(dir: &Path) -> PathBuf {
    rewritten_sampler(
        dir,
        "sampler-0.3.0.wasm",
        b"plughost:plugin/sampling@0.2.0",
        b"plughost:plugin/sampling@0.3.0",
    )
}

/// A copy of the standard sampler whose `sampling-params` record names its fourth field
/// `max-p` where the contract says `min-p`: a record of another shape under the same version.
fn renamed_field_component(dir: &Path) -> PathBuf {
    rewritten_sampler(dir, "sampler-max-p.wasm", b"min-p", b"max-p")
}

/// The standard sampler with every `from` replaced by `to`, of the same length, in `dir`.
fn rewritten_sampler(dir: &Path, file: &str, from: &[u8], to: &[u8]) -> PathBuf {
    assert_eq!(from.len(), to.len());
    let bytes = std::fs::read(plugin("plughost_sampler_standard.wasm")).expect("the sampler");
    let mut out = bytes.clone();
    let mut replaced = 0;
    for start in 0..bytes.len().saturating_sub(from.len()) {
        if &bytes[start..start + from.len()] == from {
            out[start..start + to.len()].copy_from_slice(to);
            replaced += 1;
        }
    }
    assert!(
        replaced > 0,
        "the sampler holds {:?}",
        String::from_utf8_lossy(from)
    );
    let path = dir.join(file);
    std::fs::write(&path, out).expect("write the rewritten sampler");
    path
}

/// The fcfs scheduler with the sampler of `other_version_component`.
pub(super) fn other_version_deployment(dir: &Path) -> String {
    format!(
        "[scheduler]\ncomponent = \"{}\"\n\n[sampler]\ncomponent = \"{}\"\n",
        plugin("plughost_scheduler_fcfs.wasm"),
        other_version_component(dir).display()
    )
}
