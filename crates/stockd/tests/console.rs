//! The operations console in a real browser: `console/console.spec.mjs` (Playwright,
//! `playwright-core` from npm, driving Debian's headless Chromium) against this binary's
//! `stockd serve --demo`. It needs `node`, `npm` and `/usr/bin/chromium` (the package
//! `chromium`; `.ci/run` installs it): without them the test says so loudly and
//! passes, except under `CI=true`, where it fails. The npm package is installed from
//! the committed lock file on the first run.
//!
//! The screenshots go to a scratch directory; `STOCKD_CONSOLE_SCREENSHOTS=docs/console`
//! (from the repository's root) writes the ones the README shows.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const STOCKD: &str = env!("CARGO_BIN_EXE_stockd");
const CHROMIUM: &str = "/usr/bin/chromium";

fn tests_directory() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/console")
}

fn found(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Whether the browser test can run here; says why not (a failure under CI).
fn browser_available() -> bool {
    let missing: Vec<&str> = [
        ("node", found("node")),
        ("npm", found("npm")),
        (CHROMIUM, Path::new(CHROMIUM).exists()),
    ]
    .into_iter()
    .filter(|(_, present)| !present)
    .map(|(name, _)| name)
    .collect();
    if missing.is_empty() {
        return true;
    }
    let message = format!(
        "the console's browser test needs {} (apt-get install chromium nodejs npm)",
        missing.join(", ")
    );
    assert!(std::env::var("CI").as_deref() != Ok("true"), "{message}");
    eprintln!("SKIPPED (not under CI): {message}");
    false
}

/// `npm ci` from the committed lock file, once.
fn install_playwright() {
    let directory = tests_directory();
    if directory
        .join("node_modules/playwright-core/package.json")
        .exists()
    {
        return;
    }
    let status = Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund"])
        .current_dir(&directory)
        .status()
        .expect("npm runs");
    assert!(status.success(), "npm ci in {}", directory.display());
}

struct Server {
    child: Child,
    directory: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

/// `stockd serve --demo` on a free port with `token` as its admin token; its URL.
fn serve_demo(token: &str) -> (Server, String) {
    let directory =
        std::env::temp_dir().join(format!("stockd-console-{:016x}", rand::random::<u64>()));
    std::fs::create_dir_all(&directory).unwrap();
    let mut command = Command::new(STOCKD);
    for (name, _) in std::env::vars() {
        if name.starts_with("STOCKD_") {
            command.env_remove(name);
        }
    }
    let mut child = command
        .current_dir(&directory)
        .env("STOCKD_ADMIN_TOKEN", token)
        .args(["serve", "--demo", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut url = None;
    for line in lines.take(20) {
        let line = line.unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            url = rest.split_whitespace().next().map(str::to_owned);
            break;
        }
    }
    let url = url.expect("serve prints where it listens");
    (Server { child, directory }, url)
}

#[test]
fn an_operators_day_in_the_console_works_in_a_real_browser_and_a_stranger_sees_nothing() {
    if !browser_available() {
        return;
    }
    install_playwright();
    let token = format!("console-test-{:016x}", rand::random::<u64>());
    let (server, url) = serve_demo(&token);
    let screenshots = match std::env::var("STOCKD_CONSOLE_SCREENSHOTS") {
        Ok(directory) => PathBuf::from(directory),
        Err(_) => server.directory.join("screenshots"),
    };

    let output = Command::new("node")
        .arg("console.spec.mjs")
        .current_dir(tests_directory())
        .env("STOCKD_URL", &url)
        .env("STOCKD_ADMIN_TOKEN", &token)
        .env("STOCKD_SCREENSHOTS", &screenshots)
        .output()
        .expect("node runs");

    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{printed}");
    assert!(printed.contains("console: every step held"), "{printed}");
    for page in [
        "docs", "catalog", "delete", "stock", "orders", "audit", "live", "login",
    ] {
        assert!(
            screenshots.join(format!("{page}.png")).exists(),
            "a screenshot of {page}"
        );
    }
    drop(server);
}
