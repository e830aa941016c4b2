//! One keep-alive HTTP/1.1 connection per simulated client. A client sends its requests
//! one after another on its own connection, as a checkout service's worker would.

use std::net::SocketAddr;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper::header::HeaderValue;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// A request as the lab sends it.
#[derive(Debug, Clone)]
pub struct WireRequest {
    pub method: Method,
    pub path: String,
    pub idempotency_key: Option<String>,
    /// The `Authorization` header's value (`Bearer …`), built once per credential.
    pub authorization: Option<HeaderValue>,
    pub content_type: Option<&'static str>,
    /// `Stockd-Consistency-Token`, for display reads that must see a write.
    pub consistency_token: Option<String>,
    pub body: Bytes,
}

impl WireRequest {
    pub fn get(path: impl Into<String>) -> WireRequest {
        WireRequest {
            method: Method::GET,
            path: path.into(),
            idempotency_key: None,
            authorization: None,
            content_type: None,
            consistency_token: None,
            body: Bytes::new(),
        }
    }

    /// A JSON body serialized from `body`: a `serde_json::Value`, or a typed value
    /// that writes its fields without building a document first.
    pub fn json(
        method: Method,
        path: impl Into<String>,
        body: &impl serde::Serialize,
    ) -> WireRequest {
        WireRequest {
            method,
            path: path.into(),
            idempotency_key: None,
            authorization: None,
            content_type: Some("application/json"),
            consistency_token: None,
            // Writing into a `Vec` fails only for a map with keys that are not strings:
            // a body the lab cannot send is its own bug, not an empty request.
            body: Bytes::from(
                serde_json::to_vec(body).expect("a request body's maps have string keys"),
            ),
        }
    }

    pub fn key(mut self, key: impl Into<String>) -> WireRequest {
        self.idempotency_key = Some(key.into());
        self
    }

    pub fn consistency_token(mut self, token: impl Into<String>) -> WireRequest {
        self.consistency_token = Some(token.into());
        self
    }

    pub fn bearer(self, token: &str) -> WireRequest {
        self.authorized(authorization(token))
    }

    /// With an `Authorization` value built by [`authorization`] (shared by a client's
    /// requests instead of formatted for each).
    pub fn authorized(mut self, authorization: Option<HeaderValue>) -> WireRequest {
        self.authorization = authorization;
        self
    }
}

/// The `Authorization` header for a bearer token; `None` for a token no header can
/// carry (which the server then sees as no credential).
pub fn authorization(token: &str) -> Option<HeaderValue> {
    let mut value = HeaderValue::from_str(&format!("Bearer {token}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

/// What came back.
#[derive(Debug, Clone)]
pub struct WireReply {
    pub status: u16,
    pub replayed: bool,
    /// `Stockd-Consistency-Token` of a write's answer.
    pub consistency_token: Option<String>,
    /// `Stockd-Served-By` of a display answer.
    pub served_by: Option<String>,
    pub body: Bytes,
}

/// What stockd's detail says on a refusal it gave from memory (at its end): the
/// answer was stored under no key (engine::sold_out, engine::admission).
const NOT_RECORDED: &str = "not recorded under the key)";

impl WireReply {
    /// Whether this is a refusal an instance gave from its memory, stored under no key.
    pub fn answered_from_memory(&self) -> bool {
        self.status == 409
            && self.code().is_some()
            && std::str::from_utf8(&self.body).is_ok_and(|body| body.contains(NOT_RECORDED))
    }

    /// The problem document's `code`, for error statuses.
    pub fn code(&self) -> Option<String> {
        if self.status < 400 {
            return None;
        }
        /// Only the field the lab reads: the others are skipped, not built into a
        /// document (a sold-out answer's five strings, at every refusal of a flash sale).
        /// Unlike a document, it reads a body naming `code` twice as having none; the
        /// server writes each field once.
        #[derive(serde::Deserialize)]
        struct Problem {
            code: Option<String>,
        }
        // serde reads a struct from an array too; a problem document is an object.
        if self.body.trim_ascii_start().first() != Some(&b'{') {
            return None;
        }
        serde_json::from_slice::<Problem>(&self.body)
            .ok()
            .and_then(|problem| problem.code)
    }

    pub fn json(&self) -> Result<serde_json::Value, String> {
        serde_json::from_slice(&self.body).map_err(|error| format!("response is not JSON: {error}"))
    }
}

/// Attempts per request when the connection breaks before an answer. Every mutating
/// request carries an Idempotency-Key, so sending it again is safe: that is the point.
const SEND_ATTEMPTS_MAX: u32 = 3;

/// Longest wait for one answer, connecting and retries included. The server answers
/// within its own request bound (30 s by default); past this one the server is not
/// answering at all (stopped, or not stockd), and a load run must still end by itself.
pub const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

pub struct HttpConnection {
    address: SocketAddr,
    answer_timeout: std::time::Duration,
    /// The `Host` header, formatted once: formatting the address for every request
    /// was about 1 % of a flash sale's instructions, the load generator's share of the
    /// same two cores (docs/BENCHMARKS.md, twenty-third session).
    host: HeaderValue,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl HttpConnection {
    pub fn new(address: SocketAddr) -> HttpConnection {
        HttpConnection {
            address,
            answer_timeout: ANSWER_TIMEOUT,
            host: HeaderValue::try_from(address.to_string())
                .expect("a socket address is a valid header value"),
            sender: None,
        }
    }

    async fn connect(address: SocketAddr) -> Result<SendRequest<Full<Bytes>>, String> {
        let stream = TcpStream::connect(address)
            .await
            .map_err(|error| format!("connect {address}: {error}"))?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|error| format!("handshake: {error}"))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }

    /// This connection with another answer bound.
    pub fn with_answer_timeout(mut self, answer_timeout: std::time::Duration) -> HttpConnection {
        self.answer_timeout = answer_timeout;
        self
    }

    /// Sends `request` and reads its answer, within the answer bound; a connection
    /// that gave no answer in time is dropped.
    pub async fn send(&mut self, request: &WireRequest) -> Result<WireReply, String> {
        let bound = self.answer_timeout;
        match tokio::time::timeout(bound, self.send_unbounded(request)).await {
            Ok(answered) => answered,
            Err(_) => {
                self.sender = None;
                Err(format!("no answer within {bound:?}"))
            }
        }
    }

    async fn send_unbounded(&mut self, request: &WireRequest) -> Result<WireReply, String> {
        let mut last_error = String::new();
        for _ in 0..SEND_ATTEMPTS_MAX {
            if self.sender.as_ref().is_none_or(SendRequest::is_closed) {
                self.sender = Some(HttpConnection::connect(self.address).await?);
            }
            let Some(sender) = self.sender.as_mut() else {
                continue;
            };
            if let Err(error) = sender.ready().await {
                last_error = format!("connection not ready: {error}");
                self.sender = None;
                continue;
            }
            let mut builder = Request::builder()
                .method(request.method.clone())
                .uri(&request.path)
                .header("host", self.host.clone());
            if let Some(key) = &request.idempotency_key {
                builder = builder.header("idempotency-key", key);
            }
            if let Some(authorization) = &request.authorization {
                builder = builder.header("authorization", authorization.clone());
            }
            if let Some(token) = &request.consistency_token {
                builder = builder.header("stockd-consistency-token", token);
            }
            if let Some(content_type) = request.content_type {
                builder = builder.header("content-type", content_type);
            }
            let http_request = builder
                .body(Full::new(request.body.clone()))
                .map_err(|error| format!("building the request: {error}"))?;
            match sender.send_request(http_request).await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let replayed = response
                        .headers()
                        .get("idempotent-replayed")
                        .is_some_and(|value| value == "true");
                    let header = |name: &str| {
                        response
                            .headers()
                            .get(name)
                            .and_then(|value| value.to_str().ok())
                            .map(str::to_owned)
                    };
                    let consistency_token = header("stockd-consistency-token");
                    let served_by = header("stockd-served-by");
                    let body = response
                        .into_body()
                        .collect()
                        .await
                        .map_err(|error| format!("reading the body: {error}"))?
                        .to_bytes();
                    return Ok(WireReply {
                        status,
                        replayed,
                        consistency_token,
                        served_by,
                        body,
                    });
                }
                Err(error) => {
                    last_error = format!("sending: {error}");
                    self.sender = None;
                }
            }
        }
        Err(last_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_server_that_never_answers_ends_the_request_with_an_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        // Accepts, reads nothing, answers nothing, keeps the connection open.
        let silent = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let mut connection =
            HttpConnection::new(address).with_answer_timeout(std::time::Duration::from_millis(100));
        // Without the bound the send waits forever; the guard only keeps that from
        // holding the run.
        let sent = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            connection.send(&WireRequest::get("/healthz")),
        )
        .await
        .expect("the send ends by itself");
        let error = sent.expect_err("no answer came");
        assert!(error.contains("no answer within"), "{error}");
        silent.abort();
    }

    fn reply(status: u16, body: &str) -> WireReply {
        WireReply {
            status,
            replayed: false,
            consistency_token: None,
            served_by: None,
            body: Bytes::from(body.to_owned()),
        }
    }

    #[test]
    fn a_refusal_stored_under_no_key_is_told_from_the_database_s() {
        let memory = r#"{"type":"urn:stockd:problem:insufficient_stock","title":"Not enough stock available","status":409,"code":"insufficient_stock","detail":"sku 'S' has fewer than 1 units available in warehouse 'default' (this instance found it so within the last 1000 ms; not recorded under the key)"}"#;
        let database = r#"{"type":"urn:stockd:problem:insufficient_stock","title":"Not enough stock available","status":409,"code":"insufficient_stock","detail":"requested 1, available 0"}"#;
        assert!(reply(409, memory).answered_from_memory());
        assert!(!reply(409, database).answered_from_memory());
        assert!(!reply(201, memory).answered_from_memory());
    }

    #[test]
    fn a_reply_names_the_code_of_its_problem_document_only() {
        let sold_out = r#"{"type":"urn:stockd:problem:insufficient_stock","title":"Not enough stock available","status":409,"code":"insufficient_stock","detail":"campaign 'c' is \"sold\" out"}"#;
        assert_eq!(
            reply(409, sold_out).code().as_deref(),
            Some("insufficient_stock")
        );
        assert_eq!(
            reply(400, r#" {"code":"invalid_\u0061rgument"}"#)
                .code()
                .as_deref(),
            Some("invalid_argument")
        );
        // Not an error, no code, a code that is no string, not an object, not JSON.
        assert_eq!(reply(201, r#"{"code":"insufficient_stock"}"#).code(), None);
        assert_eq!(reply(409, r#"{"detail":"x"}"#).code(), None);
        assert_eq!(reply(409, r#"{"code":409}"#).code(), None);
        assert_eq!(reply(409, r#"["insufficient_stock"]"#).code(), None);
        assert_eq!(reply(409, r#"{"code":"a","code":"b"}"#).code(), None);
        assert_eq!(reply(502, "Bad Gateway").code(), None);
    }
}
