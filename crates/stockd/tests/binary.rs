//! The `stockd` binary as a newcomer meets it: `serve` with no flags on an empty
//! directory, then `audit`; and `migrate`.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use acceptance::http::request;

const STOCKD: &str = env!("CARGO_BIN_EXE_stockd");

struct ScratchDirectory(PathBuf);

impl ScratchDirectory {
    fn new() -> ScratchDirectory {
        let path =
            std::env::temp_dir().join(format!("stockd-binary-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&path).unwrap();
        ScratchDirectory(path)
    }
}

impl Drop for ScratchDirectory {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `stockd` command in `directory` with none of the STOCKD_* variables of the
/// environment that runs the tests.
fn stockd(directory: &Path) -> Command {
    let mut command = Command::new(STOCKD);
    command.current_dir(directory);
    for (name, _) in std::env::vars() {
        if name.starts_with("STOCKD_") {
            command.env_remove(name);
        }
    }
    command
}

/// Starts `stockd serve` on a free port; returns the process, its address and the
/// admin token it printed.
fn start_serving(directory: &Path) -> (Child, SocketAddr, String) {
    let mut child = stockd(directory)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let token_line = lines.next().unwrap().unwrap();
    let token = token_line.rsplit(' ').next().unwrap().to_owned();
    let listening = lines.next().unwrap().unwrap();
    let address = listening
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    (child, address, token)
}

fn terminate(child: &mut Child) -> std::process::ExitStatus {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    child.wait().unwrap()
}

#[tokio::test]
async fn serve_with_no_flags_creates_the_database_prints_a_token_and_stops_on_sigterm() {
    let directory = ScratchDirectory::new();
    let (mut child, address, token) = start_serving(&directory.0);
    assert_eq!(token.len(), 64, "a generated token of 32 random bytes");
    let bearer = format!("Bearer {token}");

    let created = request(
        address,
        "PUT",
        "/v1/skus/TEA",
        &[("Authorization", &bearer), ("Idempotency-Key", "sku")],
        Some(r#"{"title":"Tea","price":350,"currency":"CNY"}"#),
    )
    .await
    .unwrap();
    assert_eq!(created.status, 201, "{created:?}");
    let received = request(
        address,
        "POST",
        "/v1/skus/TEA/stock-movements",
        &[("Authorization", &bearer), ("Idempotency-Key", "receive")],
        Some(r#"{"kind":"receive","quantity":2}"#),
    )
    .await
    .unwrap();
    assert_eq!(received.status, 201);
    let reserved = request(
        address,
        "POST",
        "/v1/reservations",
        &[("Idempotency-Key", "reserve")],
        Some(r#"{"lines":[{"sku":"TEA","quantity":1}]}"#),
    )
    .await
    .unwrap();
    assert_eq!(reserved.status, 201);
    let exit = terminate(&mut child);

    assert!(exit.success(), "SIGTERM is a clean stop: {exit:?}");
    assert!(directory.0.join("stockd-data/stockd.db").exists());
    let audit = stockd(&directory.0).arg("audit").output().unwrap();
    assert_eq!(
        audit.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&audit.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&audit.stdout).unwrap();
    assert_eq!(report["ok"], true);
    assert_eq!(report["ledger_rows_checked"], 2);
}

#[tokio::test]
async fn audit_exits_non_zero_when_a_counter_was_changed_by_hand() {
    let directory = ScratchDirectory::new();
    let migrate = stockd(&directory.0).arg("migrate").output().unwrap();
    assert!(
        migrate.status.success(),
        "{}",
        String::from_utf8_lossy(&migrate.stderr)
    );
    let (mut child, address, token) = start_serving(&directory.0);
    let bearer = format!("Bearer {token}");
    for (path, key, body) in [
        ("/v1/skus/SALT", "sku", r#"{"title":"Salt"}"#),
        (
            "/v1/skus/SALT/stock-movements",
            "receive",
            r#"{"kind":"receive","quantity":4}"#,
        ),
    ] {
        let method = if key == "sku" { "PUT" } else { "POST" };
        let response = request(
            address,
            method,
            path,
            &[("Authorization", &bearer), ("Idempotency-Key", key)],
            Some(body),
        )
        .await
        .unwrap();
        assert_eq!(response.status, 201, "{response:?}");
    }
    assert!(terminate(&mut child).success());
    let database = format!(
        "sqlite://{}",
        directory.0.join("stockd-data/stockd.db").display()
    );
    let mut connection = <sqlx::SqliteConnection as sqlx::Connection>::connect(&database)
        .await
        .unwrap();
    sqlx::query("UPDATE stock SET available = 40 WHERE sku = 'SALT'")
        .execute(&mut connection)
        .await
        .unwrap();

    let audit = stockd(&directory.0).arg("audit").output().unwrap();

    assert_eq!(audit.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&audit.stdout).unwrap();
    assert_eq!(report["ok"], false);
    assert_eq!(report["differences"][0]["check"], "ledger_vs_available");
}

#[test]
fn an_unreachable_database_is_reported_with_exit_code_two() {
    let directory = ScratchDirectory::new();
    let output = stockd(&directory.0)
        .args(["audit", "--database-url", "mysql://nowhere"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot open the database"));
}
