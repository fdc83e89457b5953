// Preloaded into the Node agents under test (NODE_OPTIONS=--require): tests never touch
// the network, and some agents fetch from home at start (Continue's CLI asks its hub for
// the latest version). Their fetch reaches loopback only; anything else fails at once.
"use strict";
const loopback = new Set(["127.0.0.1", "localhost", "[::1]"]);
const realFetch = globalThis.fetch;
globalThis.fetch = function offlineFetch(input, init) {
  const url = new URL(typeof input === "object" && "url" in input ? input.url : String(input));
  if (!loopback.has(url.hostname)) {
    return Promise.reject(new TypeError(`offline test run: no fetch to ${url.host}`));
  }
  return realFetch(input, init);
};
