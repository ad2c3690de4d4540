// The REST API: fetch with the session cookie, the CSRF header on actions, problem+json as errors.

let csrfToken = null;
let onUnauthorized = () => {};

/** Remember the session's CSRF token (sent as X-CSRF-Token on every state-changing request). */
export function setCsrf(token) {
  csrfToken = token || null;
}

/** Called on a 401 from anything but the login itself (the app redirects to the login page). */
export function setUnauthorizedHandler(fn) {
  onUnauthorized = fn;
}

/** An API failure: `detail` is the sentence to show the user (problem+json's `detail`). */
export class ApiError extends Error {
  constructor(status, problem) {
    const detail =
      (problem && (problem.detail || problem.title)) || `the console answered HTTP ${status}`;
    super(detail);
    this.status = status;
    this.problem = problem || null;
    this.detail = detail;
    this.kind = (problem && problem.kind) || null;
  }
}

/**
 * `api("GET", "/topics")` -> the parsed JSON body. Throws ApiError on an HTTP error (with the
 * problem's detail) and on a network failure.
 */
export async function api(method, path, body, { quiet401 = false } = {}) {
  const headers = { Accept: "application/json, application/problem+json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (method !== "GET" && method !== "HEAD" && csrfToken) headers["X-CSRF-Token"] = csrfToken;
  let response;
  try {
    response = await fetch(`/api/v1${path}`, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "same-origin",
      cache: "no-store",
    });
  } catch (err) {
    throw new ApiError(0, { detail: `cannot reach the console: ${err.message}` });
  }
  const text = await response.text();
  let data = null;
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = { detail: text.slice(0, 500) };
    }
  }
  if (!response.ok) {
    const error = new ApiError(response.status, data);
    if (response.status === 401 && !quiet401) onUnauthorized(error);
    throw error;
  }
  return data;
}

/** Path segment escaping (topic and group names may hold "%" as in %DLQ%group). */
export function seg(value) {
  return encodeURIComponent(value);
}
